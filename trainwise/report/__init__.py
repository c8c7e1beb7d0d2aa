"""The run report: `report.html` (self-contained, plots embedded) and terminal tables."""
