"""Operating a node: `krex serve` (servecli.py), `krex doctor` (doctor.py, doctor_cgroup.py,
doctor_kernel.py), `krex cleanup`, `krex status` (statusview.py), `krex trace` (tracecli.py) and
`krex demo`."""
