"""`tokenmill bench roofline`: the machine's ceilings (probe), where a workload's time goes by op
class (profile, op_classes) and the two side by side (report)."""
