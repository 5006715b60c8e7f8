"""cupycoll-bench: collective benchmarks in nccl-tests terms."""
