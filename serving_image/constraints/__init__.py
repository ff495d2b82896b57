"""Per-request step-wise constraints (ARCHITECTURE §3.5): the native core and its thin Python layer."""
