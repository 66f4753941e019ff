"""Attention kernels, one folder per backend (portable/, sm90/), and the fp32 state merge both use (merge.py)."""
