"""What the daemon tells about itself: metrics, the trace, probe attribution, the timeline and
`krex status`. Observers subscribe to the model's events; none is called by hand."""
