"""moe_ep_transport"""
