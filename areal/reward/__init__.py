"""areal.reward"""
