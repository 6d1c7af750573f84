"""The HTTP server: an aiohttp app on uvloop in front of one AsyncEngine (DESIGN.md)."""
