"""areal.core"""
