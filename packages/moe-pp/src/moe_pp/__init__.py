"""moe_pp"""
