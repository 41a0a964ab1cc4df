"""areal.dataset"""
