"""The policy rules, one module per area. Every rule is a module-level ResourceValidationPolicy or
StackValidationPolicy object; `policies.catalog` lists them all."""
