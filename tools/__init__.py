"""Developer tools that are not part of the installed package: ``make verify-gpu``
(tools/verify_gpu.py) and the small programs its stages run."""
