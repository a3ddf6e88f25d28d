"""servelab.traces"""
