"""moe_ddp"""
