"""backends/cpp"""
