"""Meters: memory (peak + breakdown), step timing, and host RSS. Trial layer: torch + stdlib only."""
