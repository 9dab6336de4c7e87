"""backends/triton"""
