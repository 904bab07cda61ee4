"""What the engine's lower layers report while a profile records: time by phase
(`hf_zero.observe.clock`). Nothing here costs anything when no profile records."""
