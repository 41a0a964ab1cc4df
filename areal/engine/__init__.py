"""The trainer side: FSDP2 engine and the models trained on it (PPO actor/critic, SFT, RM)."""
