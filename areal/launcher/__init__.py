"""areal.launcher"""
