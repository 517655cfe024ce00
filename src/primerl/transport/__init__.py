"""Hand-over formats between processes through the run directory (docs/rl.md, "The run directory"): rollout batches
(orchestrator → trainer) and weight snapshots (trainer → inference). Torch-free: numpy, safetensors.numpy and JSON
only."""
