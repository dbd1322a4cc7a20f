//! Controller scenarios against a mock API server (tower-test) and the fake provider.
