"""One engine process: its states, its keeper, the /proc facts about it, the one seam for side effects.

The floor of the house: nothing here imports the restart flow, the commands or the strategies."""
