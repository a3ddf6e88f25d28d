"""servelab.search"""
