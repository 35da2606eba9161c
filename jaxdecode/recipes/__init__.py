"""Worked examples of the research API (jaxdecode/device/research.py) as library code:

- `watermark`: a green-list watermark processor and its z-score detector;
- `guidance`: classifier-free guidance (a prompt and its negative prompt, two rows combined).
"""
