"""Endpoint state kept fresh in the background: discovery, scraping, health, in-flight counts."""
