"""moe_mxfp8"""
