"""areal.utils"""
