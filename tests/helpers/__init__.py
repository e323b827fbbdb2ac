"""What the tests share: tiny models (models), training setups (training), CLI case tables (cases)."""
