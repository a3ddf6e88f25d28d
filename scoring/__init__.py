"""servelab.scoring"""
