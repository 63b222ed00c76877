"""Self-contained GDN ReplaySSM kernels and their torch references (imports torch and triton only)."""
