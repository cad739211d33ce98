"""moecast.runtime.profile: measuring this machine into a hardware profile, and the profile command."""
