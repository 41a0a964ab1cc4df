"""areal.workflow"""
