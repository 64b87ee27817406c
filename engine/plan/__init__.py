"""Where every weight lives: the placement planner, parameter counts, the printed report."""
