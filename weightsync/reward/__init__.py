"""See DESIGN.md section 2."""
