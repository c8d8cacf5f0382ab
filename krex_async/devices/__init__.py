"""Devices of the node: one module per vendor behind devices.base.Vendor; `cpu` otherwise."""
