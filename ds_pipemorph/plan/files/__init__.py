"""The file formats the planner reads and writes: plan files (``planfile``), torch pipelining's CSV
(``torch_csv``) and link matrices (``linkmatrix``)."""
