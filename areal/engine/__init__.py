"""areal.engine"""
