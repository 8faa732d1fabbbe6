"""moe_ckpt"""
