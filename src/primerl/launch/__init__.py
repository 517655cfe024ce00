"""Launchers: run primerl's processes on this machine (`local`), in containers (`images`), on SSH hosts and on Slurm."""
