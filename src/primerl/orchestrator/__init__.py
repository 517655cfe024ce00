"""The orchestrator: runs verifiers environments against the inference server and turns rollouts into training
batches. Torch-free by design; `envkit` is what environment packages import, `rollouts` is the bridge the loop uses."""
