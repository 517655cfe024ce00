"""The trainer process: RL (`primerl trainer`) and SFT (`primerl sft`) on torch, FSDP2 when several ranks."""
