"""app/flower"""
