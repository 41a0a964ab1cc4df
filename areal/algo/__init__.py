"""areal.algo"""
