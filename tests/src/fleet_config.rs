//! The providers config the fleet tests share: hosts on documentation addresses (nothing
//! is dialled: the fleet controllers only read names and capacity) and plugins that are
//! never loaded.

/// A config with `hosts` hosts named `h1`, `h2`, ... on 192.0.2.x, one image
/// (`debian-12`) and one machine type (`tiny`), as YAML.
pub fn fleet_config(hosts: usize) -> String {
    let hosts: String = (1..=hosts)
        .map(|i| {
            format!(
                "    - {{name: h{i}, address: \"192.0.2.{i}\", storagePool: default, bridge: br0}}\n"
            )
        })
        .collect();
    format!(
        r#"clusterId: fleet
kvm2:
  ssh:
    user: egress
    privateKeyFile: /nonexistent/id_ed25519
    knownHostsFile: /nonexistent/known_hosts
  hosts:
{hosts}  images:
    - name: debian-12
      url: https://images.example.org/debian-12.qcow2
      sha256: "1111111111111111111111111111111111111111111111111111111111111111"
      format: qcow2
  machineTypes:
    - {{name: tiny, vcpus: 1, memoryMiB: 512, diskGiB: 4}}
  defaults: {{machineType: tiny, image: debian-12}}
  templates:
    domain: {{path: /nonexistent/domain.wasm}}
    vendorData: {{path: /nonexistent/vendor-data.wasm}}
"#
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_fleet_config_parses_with_its_hosts() {
        let text = super::fleet_config(2);
        let cfg =
            egress_operator::config::parse(&text, "fleet.yaml", std::path::Path::new("/")).unwrap();
        let names: Vec<&str> = cfg.kvm2.hosts.iter().map(|h| h.name.as_str()).collect();
        assert_eq!(names, ["h1", "h2"]);
    }
}
