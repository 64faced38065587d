"""The knowledge package: the blueprint (every contract of the engine as a checkable node), the model spec
report, the failure-mode library with its mutations, and the phase gates (docs/SOP.md)."""
