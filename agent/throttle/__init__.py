"""Yielding to the laptop's owner: probes (idle input, heat, battery, lid, lock, foreground
load), a pure policy with hysteresis, and the controller that applies it to the agent."""
