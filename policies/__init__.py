"""servelab.policies"""
