"""Hand-over formats between processes through the run directory (DESIGN §3.2): rollout batches (orchestrator →
trainer) and weight snapshots (trainer → inference). Torch-free: numpy, safetensors.numpy and JSON only."""
