"""Evidence: pure records -> metrics -> decisions, the evidence document, audit and report."""
