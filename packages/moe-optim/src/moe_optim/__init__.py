"""moe_optim"""
