"""Generation engines behind the inference server. `base` holds the contract; `hf` the embedded engine."""
