"""servelab.runners"""
