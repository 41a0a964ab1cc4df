"""areal.api"""
