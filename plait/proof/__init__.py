"""The proof tools: what shows a layout keeps plait's promises, apart from what trains.

bench (throughput, memory, MFU side by side), baseline (a plain PyTorch loop to measure against),
compare (per-step loss drift between layouts), trace (which collectives ran, by phase and dtype),
probe (which dtype each matmul and collective actually used).
"""
